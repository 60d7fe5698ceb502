"""The synthesis engine: requests, scheduling, batched LM decode and token2wav."""
