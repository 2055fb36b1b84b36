"""An encoder-decoder Transformer with pluggable attention scoring and positional encodings."""
