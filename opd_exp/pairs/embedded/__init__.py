"""The embedded pair: a character tokenizer and a tiny Qwen2 teacher/student that the project
trains itself on the arithmetic task and caches (see docs/world.md)."""
