"""Official model directories (CosyVoice 2 and 3): families, layout, hyperparameters, download, manifest."""
