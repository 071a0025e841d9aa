// Landing page: go to the rater page of the invite code typed in.
document.getElementById("enter").addEventListener("submit", function (event) {
  event.preventDefault();
  var code = document.getElementById("code").value.trim();
  if (code) location.href = "/r/" + encodeURIComponent(code);
});
