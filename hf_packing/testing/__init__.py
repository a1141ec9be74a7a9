"""Scaffolding for tests, the demo and benchmarks: tiny random Qwen-VL models and processors built locally
(`tiny`), and a generated multimodal dataset (`synthetic`). Nothing here is needed to train."""
