"""Infrastructure: the artifact store (local or S3), the trajectory schema, the store
layout, stage caching, MLflow tracking and the fault-injection points used by the drills."""
