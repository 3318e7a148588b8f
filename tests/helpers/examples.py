"""The example plug-in environment (examples/corridor_env.py) as tests name it."""

CORRIDOR_ENV = "corridor_env:Corridor"  # env.name of the example, importable with examples/ on sys.path
