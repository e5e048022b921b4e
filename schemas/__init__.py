"""Arrow schemas of every message and every file the project writes; encode/decode with validation. No compute."""
