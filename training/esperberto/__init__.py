"""Training EsperBERTo: the corpus and tokenizer (`data.py`), the MLM run (`train.py`) and the kurtosis
study (`study.py`); the model itself is models/esperberto."""
