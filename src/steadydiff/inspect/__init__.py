"""Reading a run, analysing it, and rendering what was found: the report and the doctor.

One room per concern, so a new check or a new plot touches one file:

    read.py       the run directory as data (RunLog, read_run, read_jsonl, metric_series)
    verdict.py    the report's one-line verdict (healthy / recovered / aborted / ...)
    plots.py      the report's matplotlib figures, as PNG data URIs
    html.py       the report page (render)
    causes.py     the doctor's vocabulary: Cause, Diagnosis, rank, link
    stats.py      robust statistics shared by the checks (robust_z, ks_distance, ...)
    weights.py    doctor: weight and EMA checks against a fresh initialization
    probe.py      doctor: the probe forward pass and its checks
    history.py    doctor: the run's record (how it ended, incidents, loss, config lint)
    model.py      doctor: the model of a checkpoint, and a freshly initialised one
    diagnose.py   doctor: diagnose() and diagnose_model(), the entry points
    text.py       doctor: the human-readable output (format_diagnosis)

Incident rows are read through :mod:`steadydiff.guard.findings` (one typed record per kind);
the public entry points stay :mod:`steadydiff.report` and :mod:`steadydiff.doctor`.
"""
