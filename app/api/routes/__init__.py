"""HTTP routes: ``public`` for clients, ``internal`` for workers (token per machine)."""
