"""Operations glue: lineage (MLflow), dvc.yaml generation, the run lock, the iteration report."""
