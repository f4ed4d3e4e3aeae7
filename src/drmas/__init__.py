"""drmas."""
