#!/bin/busybox sh
# /init of the lab's L1 guest (packed into the initramfs by scripts/lab/kit.sh).
# It loads the 9p stack, mounts the host's root read-only at /host and the run
# directory read-write at its host path, loads kvm and kvm_amd from the kit,
# then runs the run directory's `cmd` chrooted into the host's root with its
# output on ttyS1, writes the exit status to `status` and powers off.
# Kernel parameters: rollbox.run=<run dir> rollbox.kit=<kit dir>.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

fail() {
    echo "rollbox-lab: error: $*" > /dev/ttyS0
    [ -n "$run" ] && [ -d "/host$run" ] && echo "$*" > "/host$run/lab-error"
    sync
    poweroff -f
}

run="" kit=""
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        rollbox.run=*) run="${arg#rollbox.run=}" ;;
        rollbox.kit=*) kit="${arg#rollbox.kit=}" ;;
    esac
done
[ -n "$run" ] && [ -n "$kit" ] || fail "rollbox.run= and rollbox.kit= must be on the kernel command line"

for m in $(cat /modules/order); do
    insmod "/modules/$m" || fail "the L1 kernel refused module $m"
done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288,cache=loose hostroot /host ||
    fail "cannot mount the host's root over 9p"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 labrun "/host$run" ||
    fail "cannot mount the run directory $run over 9p"
# Host paths under /tmp, /run or /dev/shm that must stay visible (the command's working
# directory, say), one per line in the run directory's `keep`: bound aside before the fresh
# tmpfs covers them, then bound back at the same path.
keep_paths="$(cat "/host$run/keep" 2>/dev/null)"
for dir in /tmp /run; do
    for p in $keep_paths; do
        case "$p" in "$dir"/*) mkdir -p "/keep$p" && mount --bind "/host$p" "/keep$p" ;; esac
    done
done
mount -t proc proc /host/proc
mount -t sysfs sysfs /host/sys
mount -t cgroup2 cgroup2 /host/sys/fs/cgroup
mount -t devtmpfs devtmpfs /host/dev
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /host/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /host/dev/shm
mount -t tmpfs -o mode=1777,size=75% tmpfs /host/tmp
mount -t tmpfs -o mode=0755 tmpfs /host/run
for p in $keep_paths; do
    if [ -d "/keep$p" ]; then
        mkdir -p "/host$p" && mount --bind "/keep$p" "/host$p" || fail "cannot keep $p visible in L1"
    fi
done
hostname rollbox-lab
ip link set lo up

release="$(cat "/host$kit/kit-info" | sed -n 's/^release=//p')"
load() {
    chroot /host /sbin/modprobe -d "$kit/root" -S "$release" "$@" ||
        fail "module $1 does not load in L1 (does QEMU offer svm and npt?)"
}
load kvm
# No virtual GIF: with it, L1's KVM livelocked in an L2 vCPU thread (soft lockups, L1 frozen)
# about once in 25 Linux boots under QEMU 7.2's TCG; without it, none in hundreds.
load kvm_amd vgif=0
for m in $(cat "/host$run/modules" 2>/dev/null); do
    load "$m"
done
[ -c /host/dev/kvm ] || fail "kvm_amd loaded but /dev/kvm is missing"
# Modules the kernel asks for on its own (nftables expressions, veth, ...) come from the kit too.
cat > /lab-modprobe <<EOF
#!/bin/busybox sh
exec /bin/busybox chroot /host /sbin/modprobe -d "$kit/root" -S "$release" "\$@"
EOF
chmod 0755 /lab-modprobe
echo /lab-modprobe > /proc/sys/kernel/modprobe

stty -F /dev/ttyS1 raw -echo 2>/dev/null
# A heartbeat for the host (scripts/lab/run.sh stops an L1 whose heartbeat stops): a count, not
# a time, since L1's clock may drift from the host's.
(
    beat=0
    while :; do
        beat=$((beat + 1))
        echo "$beat" > "/host$run/heartbeat"
        sleep 10
    done
) &
chroot /host /bin/bash "$run/cmd" > /dev/ttyS1 2>&1 < /dev/null
echo "$?" > "/host$run/status"
sync
poweroff -f
