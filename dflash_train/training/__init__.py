"""The training recipe: setup steps (recipe), the Lightning module, its metrics, online target labels,
preemption handling and the launch stamp."""
