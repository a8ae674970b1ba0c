"""Data stages: demo corpus, tokenizer training, pretokenization."""
