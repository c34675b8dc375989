"""Fast tests of single modules: no model, no Ray."""
