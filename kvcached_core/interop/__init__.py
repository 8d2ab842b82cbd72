"""Reading segments written by other allocators (the public kvcached's)."""
