"""The window: its launch (the engine thread wired to the Qt window), the runner the window talks to, and the
platform check before Qt starts."""
