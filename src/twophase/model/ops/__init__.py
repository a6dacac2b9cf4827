"""CPU kernels of our own (C++ extension built on first use) and their plain-torch references."""
