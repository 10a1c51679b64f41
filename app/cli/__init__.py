"""``homefleet``: the command line (typer), one module per command group."""
