"""Reading runs: a run's report (figures, tables) and ``drmas compare`` across modes and seeds."""
