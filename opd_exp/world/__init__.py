"""The embedded default world: a synthetic arithmetic task, a character tokenizer and a tiny
Qwen2 teacher/student pair that the project trains itself and caches (see docs/world.md)."""
