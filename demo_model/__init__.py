"""The mlx-trio-demo model: synthetic data, training, export and evaluation.

``demo_model.data`` writes the synthetic conversations and builds the
tokenizer, ``demo_model.train`` trains a small Qwen3 model from a seed and
exports an MLX model directory, ``demo_model.evaluate`` scores a model
directory on held-out prompts. See ``demo_model/README.md``.
"""

MODEL_ID = "mlx-trio-demo"
