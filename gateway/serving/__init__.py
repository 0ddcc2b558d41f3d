"""Serving: the ASGI app and its routes, the process lifecycle (startup, drain), the worker
supervisor, and the HTTP/1.1 and ASGI plumbing under them."""
