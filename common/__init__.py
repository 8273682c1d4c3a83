"""What every control-plane app shares, below them all: a few admin pieces. No models."""
