"""The OpenAI API layer (engine/api) against scripted and real engines, without Ray."""
