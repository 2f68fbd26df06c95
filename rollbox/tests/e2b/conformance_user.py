"""E2B's default user and home, checked with the stock SDK (sync and async).

envd 0.4+ runs a request that names no user as the template's default user, `user` with
home /home/user in E2B's templates, and the SDK then sends no username. rollbox does the same
when the sandbox's rootfs has the account (image builds add it), else root in /root.

`user_checks` and `async_user_checks` hold in both places the suites run: a real guest, and
the host-agent mode of rollbox/tests/e2b.rs, where the agent maps `user` onto its own uid with
a scratch home (so `whoami` there names the host's account, not `user`). `linux_user_checks`
holds only in a real Linux template built from an image: `whoami` is `user`, and files belong
to it. Each check prints `ok NAME`; a failure raises.
"""

from e2b import AsyncSandbox

from checks import ok


def _identity(result):
    """`USER`, `HOME` and the cwd printed by IDENTITY."""
    lines = result.stdout.splitlines()
    assert len(lines) == 3, result
    return lines


IDENTITY = 'echo "$USER"; echo "$HOME"; pwd'


def user_checks(sbx):
    """The default user: its USER, HOME and cwd agree with where the files API puts relative paths."""
    user, home, cwd = _identity(sbx.commands.run(IDENTITY))
    assert user == "user", (user, home, cwd)
    assert home == cwd and home.startswith("/"), (home, cwd)
    assert sbx.files.get_info("~").path == home, home
    ok(f"the default user is `user`, HOME and cwd are its home ({home})")

    name = f"conformance-user-{sbx.sandbox_id}.txt"
    info = sbx.files.write(name, "relative")
    assert info.path == f"{home}/{name}", (info.path, home)
    assert sbx.commands.run(f"cat {name}").stdout == "relative", "the command's cwd is not the files' home"
    assert sbx.files.read(f"~/{name}") == "relative"
    assert sbx.files.read(f"{home}/{name}") == "relative"
    sbx.files.remove(name)
    assert not sbx.files.exists(f"{home}/{name}")
    ok("a relative files.write lands in the home, where commands run")

    user, home, cwd = _identity(sbx.commands.run(IDENTITY, user="root"))
    assert (user, home, cwd) == ("root", "/root", "/root"), (user, home, cwd)
    assert sbx.commands.run("id -un", user="root").stdout == "root\n"
    assert sbx.files.get_info("~", user="root").path == "/root"
    ok('user="root" is root in /root')


async def async_user_checks(sandbox_id):
    """The same through the async SDK."""
    sbx = await AsyncSandbox.connect(sandbox_id)
    user, home, cwd = _identity(await sbx.commands.run(IDENTITY))
    assert user == "user" and home == cwd, (user, home, cwd)
    name = f"conformance-user-async-{sandbox_id}.txt"
    info = await sbx.files.write(name, "async")
    assert info.path == f"{home}/{name}", (info.path, home)
    assert (await sbx.commands.run(f"cat {name}")).stdout == "async"
    await sbx.files.remove(name)
    user, home, cwd = _identity(await sbx.commands.run(IDENTITY, user="root"))
    assert (user, home, cwd) == ("root", "/root", "/root"), (user, home, cwd)
    ok("the async SDK: the default user, its home, relative files, user=root")


def linux_user_checks(sbx):
    """What only a Linux template built from an image shows: the account is really `user`."""
    result = sbx.commands.run('whoami; pwd; echo "$HOME"; id -u')
    whoami, cwd, home, uid = result.stdout.splitlines()
    assert (whoami, cwd, home) == ("user", "/home/user", "/home/user"), result
    assert uid != "0", result
    ok(f"Linux: whoami is user (uid {uid}) in /home/user")

    info = sbx.files.write("linux-user/deep/file.txt", "mine")
    assert info.path == "/home/user/linux-user/deep/file.txt", info.path
    owners = sbx.commands.run("stat -c %U:%G linux-user linux-user/deep linux-user/deep/file.txt")
    assert owners.stdout.splitlines() == ["user:user"] * 3, owners
    # The user can change what the files API wrote for it.
    sbx.commands.run("echo more >> linux-user/deep/file.txt && rm -r linux-user")
    assert not sbx.files.exists("/home/user/linux-user")
    ok("Linux: a relative files.write lands in /home/user, owned by user with its new parents")

    result = sbx.commands.run("whoami; pwd", user="root")
    assert result.stdout == "root\n/root\n", result
    info = sbx.files.write("linux-root.txt", "root's", user="root")
    assert info.path == "/root/linux-root.txt", info.path
    owner = sbx.commands.run("stat -c %U /root/linux-root.txt", user="root").stdout
    assert owner == "root\n", owner
    sbx.files.remove("/root/linux-root.txt", user="root")
    ok('Linux: user="root" runs as root in /root and writes root\'s files')
