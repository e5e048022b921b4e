"""Tests of dorylus-py."""
