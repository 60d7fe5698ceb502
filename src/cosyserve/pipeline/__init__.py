"""Speech synthesis from text and prompts: requests, voices, streaming token2wav."""
