"""PyTorch interop, decided without importing PyTorch: its store and its errors."""
