"""How the shadow run is made the same call: isolation, torch's settings, its threads and deadline."""
