#!/usr/bin/env bash
# Prints a GPU host's VFIO layout for docs/vmm.md (issue 9): /dev/vfio, IOMMU groups, each NVIDIA
# device's driver, group members and BAR sizes. It only reads: it never rebinds or resets anything.
set -u
echo "== GPU layout (read-only)"
ls -l /dev/vfio 2>&1
echo "-- kernel cmdline: $(cat /proc/cmdline)"
echo "-- IOMMU groups: $(ls /sys/kernel/iommu_groups 2>/dev/null | wc -l)"
for dev in /sys/bus/pci/devices/*; do
  vendor=$(cat "$dev/vendor" 2>/dev/null)
  [ "$vendor" = "0x10de" ] || continue
  b=$(basename "$dev")
  echo "-- $b class $(cat $dev/class) device $(cat $dev/device) driver $(basename "$(readlink $dev/driver 2>/dev/null)" 2>/dev/null) iommu_group $(basename "$(readlink $dev/iommu_group 2>/dev/null)" 2>/dev/null)"
  if [ -e "$dev/iommu_group/devices" ]; then echo "   group members: $(ls $dev/iommu_group/devices | tr '\n' ' ')"; fi
  i=0
  while read -r start end flags; do
    s=$((start)); e=$((end))
    if [ "$e" -gt 0 ]; then
      size=$((e - s + 1))
      echo "   resource$i: start $start size $((size >> 20)) MiB flags $flags"
    fi
    i=$((i + 1))
  done < "$dev/resource"
done
command -v lspci >/dev/null && lspci -d 10de: -vv 2>/dev/null | grep -E "^[0-9a-f]|Region|Capabilities: \[.*\] (MSI|Express|Resizable)|BAR [0-9]: current size|Kernel driver" | head -40
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,pci.bus_id --format=csv 2>&1 | head -5
