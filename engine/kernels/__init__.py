"""Fast paths the model never sees, each with the portable torch path as its fallback and
reference: the paged decode kernel (C, built on the user's machine), packed linears and the
compiled decode step."""
