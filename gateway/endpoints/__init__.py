"""The public API's endpoints: thin handlers that parse and validate their request body and
hand it to the shared request pipeline."""
