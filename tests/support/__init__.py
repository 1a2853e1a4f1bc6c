"""Test harnesses: processes and fakes the tests drive."""
