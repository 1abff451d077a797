"""Model building blocks: tensor-parallel aware, with pluggable weight formats."""
