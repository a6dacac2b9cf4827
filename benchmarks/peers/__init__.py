"""Peers of benchmarks/compare.py: build, launch and measure twophase, llama.cpp and vLLM CPU."""
