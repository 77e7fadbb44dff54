"""rosecourse: the course around rose's chapters: exercises, their reference solutions, and the chapters' demo helpers."""
