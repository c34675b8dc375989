"""Helpers that several test modules share: fakes, small models, Ray and Serve apps, stream
readers. No tests here; test modules import from this package, never from each other."""
