"""The engine: identifying, creating, claiming and driving runs, and the services over them."""
