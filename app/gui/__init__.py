"""The desktop app (all Qt): the window, the engine worker thread, the A/B lab, serving from
inside the app."""
