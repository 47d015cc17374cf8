"""Run-time plumbing every layer may use: the stage result type, the run lock, crash
points for tests, and progress/events. Nothing here knows about tables or jobs."""
