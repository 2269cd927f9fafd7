// PENDING (cuda backend helper)
