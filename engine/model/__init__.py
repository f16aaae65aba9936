"""The model: what a checkpoint is and how its forward pass reads the paged cache.

Layers, lowest first: `tokenizer` and `chat_format` (text <-> ids); `spec` (a checkpoint's shape: layers,
heads, window pattern, rope); `safetensors_io` and `gguf_cache` (reading the weights: an HF directory, or a
.gguf converted once into a local cache); `loader` (a path -> a loaded model); `llama_family` (`LlamaFamily`:
the forward pass of Llama / Qwen2 / Mistral-style decoders, attention through engine.attention).
Imports engine.attention and engine.kv's codecs, never engine.runtime.
"""
