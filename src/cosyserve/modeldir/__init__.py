"""The official CosyVoice2-0.5B model directory: layout, hyperparameters, generation."""
