"""The command line (no Qt): ``infersight`` and its commands, and the terminal chat."""
