"""The backend's database: models, migrations, the session-state transition, the board."""
