"""External serving engines driven as programs (llama.cpp): build, convert, serve, measure. Imports only
drafters/*.py."""
