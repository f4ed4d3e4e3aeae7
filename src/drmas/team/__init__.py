"""The team: agents (prompt, parse), orchestras (who acts when), episodes (the record of a
team's turn-by-turn interaction) and the registry that names orchestras."""
