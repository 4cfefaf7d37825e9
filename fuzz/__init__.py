"""Coverage-guided fuzz harnesses for every parser that reads hostile input (see README.md)."""
