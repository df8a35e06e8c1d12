"""vgpu: GPU slicing for containers, and the fake GPU it is proven on. Python tools (grows with the project)."""

__all__ = ["smi"]
