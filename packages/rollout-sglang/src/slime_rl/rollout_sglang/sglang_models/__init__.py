"""SGLang's external model package (``SGLANG_EXTERNAL_MODEL_PACKAGE``): its classes replace SGLang 0.5.17's own of
the same name, each differing only in ``load_weights`` (model_fixes.py says what each fixes and why). SGLang
imports every module here, and only SGLang's server processes do: nothing else imports this package."""
