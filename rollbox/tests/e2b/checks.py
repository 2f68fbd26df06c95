"""What every E2B check script shares: `ok` prints a passed check, `expect_error` and
`expect_error_async` pass when a call raises an error whose text has every given word.
(Apart from test_sdk.py because that runs as __main__ and the conformance modules it calls
would otherwise import it a second time.)
"""


def ok(name):
    print(f"ok {name}", flush=True)


def _matched(name, error, words):
    text = f"{type(error).__name__}: {error}"
    for word in words:
        assert word in text, f"{name}: {word!r} not in {text!r}"
    ok(name)
    return error


def expect_error(name, call, *words):
    try:
        call()
    except Exception as e:  # noqa: BLE001 - any SDK exception type
        return _matched(name, e, words)
    raise AssertionError(f"{name}: no error")


async def expect_error_async(name, call, *words):
    try:
        await call()
    except Exception as e:  # noqa: BLE001 - any SDK exception type
        return _matched(name, e, words)
    raise AssertionError(f"{name}: no error")
