"""Loss components shared by every draft variant's objective (pure torch, no project imports)."""
