"""``python -m dptrain.cli ...``: the same as the ``dptrain`` command."""


from dptrain.cli.main import main

if __name__ == "__main__":
    main()
