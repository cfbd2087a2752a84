"""steadydiff."""
